"""The calculator task as a LangGraph agent: a graph of a model node (langchain-openai's ``ChatOpenAI``) and a tool
node, looping while the model calls the calculator.

Ordinary LangGraph code; only ``base_url`` and ``api_key`` point at the episode's gateway. Train it with

    streamrl up configs/agent.yaml rollout.env=examples/frameworks/langgraph_agent.py:solve --fresh
"""

from __future__ import annotations

from langchain_core.messages import SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from streamrl.envs.calculator import calculate
from streamrl.envs.rewards import last_number

# the tool-call markup is spelled out: SmolLM2's chat template does not render the tools it is offered
INSTRUCTIONS = ('You can use a calculator. To call it, write <tool_call>{"name": "calculator", "arguments": '
                '{"expression": "2 * 3 + 4"}}</tool_call> and wait for the result. Finish with the number only.')


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / and parentheses)."""
    return calculate(expression)  # errors come back as text the model reads


def build(llm: ChatOpenAI):
    model = llm.bind_tools([calculator])

    async def think(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke([SystemMessage(INSTRUCTIONS), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("think", think)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "think")
    graph.add_conditional_edges("think", tools_condition)  # to the tools while the model calls them, else done
    graph.add_edge("tools", "think")
    return graph.compile()


async def solve(client, item, max_turns: int = 4):
    agent = build(ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key))
    try:
        state = await agent.ainvoke({"messages": [("user", item["question"])]},
                                    {"recursion_limit": 2 * max_turns})  # a model step and a tool step per call
    except GraphRecursionError:  # still calling the tool when its turns ran out: a wrong answer, not a broken episode
        return 0.0, {"correct": False, "answer": ""}
    return score(str(state["messages"][-1].content), item)


def score(answer: str, item) -> tuple[float, dict]:
    reward = last_number(item, answer)  # the last number in the answer is the item's
    return reward, {"correct": reward == 1.0, "answer": answer}
