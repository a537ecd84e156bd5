"""The calculator task with the OpenAI Agents SDK: an ``Agent`` with a ``@function_tool``, run by ``Runner``.

Ordinary Agents SDK code, given the episode's client (an ``AsyncOpenAI`` bound to its gateway). The SDK's
default model speaks the Responses API; the gateway serves chat completions, so the agent is given the SDK's
``OpenAIChatCompletionsModel``, as the SDK's docs do for any other chat-completions provider. Train it with

    streamrl up configs/agent.yaml rollout.env=examples/frameworks/openai_agents_agent.py:solve --fresh
"""

from __future__ import annotations

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded

from streamrl.envs.calculator import calculate
from streamrl.envs.rewards import last_number

set_tracing_disabled(True)  # traces would go to OpenAI's servers
# the tool-call markup is spelled out: SmolLM2's chat template does not render the tools it is offered
INSTRUCTIONS = ('You can use a calculator. To call it, write <tool_call>{"name": "calculator", "arguments": '
                '{"expression": "2 * 3 + 4"}}</tool_call> and wait for the result. Finish with the number only.')


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / and parentheses).

    Args:
        expression: the expression, e.g. "2 * 3 + 4"
    """
    return calculate(expression)  # errors come back as text the model reads


async def solve(client, item, max_turns: int = 4):
    # the episode's own client; AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key) works as well
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[calculator], model=model)
    try:
        result = await Runner.run(agent, item["question"], max_turns=max_turns)
    except MaxTurnsExceeded:  # still calling the tool when its turns ran out: a wrong answer, not a broken episode
        return 0.0, {"correct": False, "answer": ""}
    return score(str(result.final_output), item)


def score(answer: str, item) -> tuple[float, dict]:
    reward = last_number(item, answer)  # the last number in the answer is the item's
    return reward, {"correct": reward == 1.0, "answer": answer}
