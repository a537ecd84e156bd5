"""The calculator task with pydantic-ai: an ``Agent`` over ``OpenAIChatModel`` with a tool.

Ordinary pydantic-ai code, given the episode's client (an ``AsyncOpenAI`` bound to its gateway). Train it with

    streamrl up configs/agent.yaml rollout.env=examples/frameworks/pydantic_ai_agent.py:solve --fresh
"""

from __future__ import annotations

from pydantic_ai import Agent, UsageLimits
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from streamrl.envs.calculator import calculate
from streamrl.envs.rewards import last_number

# the tool-call markup is spelled out: SmolLM2's chat template does not render the tools it is offered
INSTRUCTIONS = ('You can use a calculator. To call it, write <tool_call>{"name": "calculator", "arguments": '
                '{"expression": "2 * 3 + 4"}}</tool_call> and wait for the result. Finish with the number only.')


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / and parentheses).

    Args:
        expression: the expression, e.g. "2 * 3 + 4"
    """
    return calculate(expression)  # errors come back as text the model reads


async def solve(client, item, max_turns: int = 4):
    # the episode's own client; OpenAIProvider(base_url=str(client.base_url), api_key=client.api_key) works as well
    model = OpenAIChatModel("policy", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, instructions=INSTRUCTIONS, tools=[calculator])
    try:
        result = await agent.run(item["question"], usage_limits=UsageLimits(request_limit=max_turns))
    except UsageLimitExceeded:  # still calling the tool when its turns ran out: a wrong answer, not a broken episode
        return 0.0, {"correct": False, "answer": ""}
    answer = str(result.output)
    reward = last_number(item, answer)  # the last number in the answer is the item's
    return reward, {"correct": reward == 1.0, "answer": answer}
